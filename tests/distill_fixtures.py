"""The student and teacher model folders of the distillation tests (tests/unit/learner/test_distill.py,
tests/e2e/test_distill_e2e.py): random digit-task models of configs/demo.py's task sharing its
tokenizer; the teacher deeper and wider than the student."""

import os

from repo_paths import REPO

ARCH = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8, rope_theta=10000.0, tie_word_embeddings=True)
# the teacher differs from the student in depth and width: only the tokenizer is shared
TEACHER_ARCH = dict(ARCH, hidden_size=48, num_layers=3, intermediate_size=96, head_dim=12,
                    tie_word_embeddings=False)


def _demo_module():
    """configs/demo.py as a module (configs/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rlflow_demo_config",
                                                  os.path.join(REPO, "configs", "demo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def student_teacher_folders(root) -> tuple[str, str]:
    """``(student, teacher)`` HF folders under ``root`` (a pathlib folder): ARCH with init
    seed 0 and TEACHER_ARCH with seed 1, both with the digit task's tokenizer."""
    build_model_folder = _demo_module().build_model_folder
    student = build_model_folder(str(root / "student"), arch=ARCH, init_seed=0)
    teacher = build_model_folder(str(root / "teacher"), arch=TEACHER_ARCH, init_seed=1)
    return student, teacher
