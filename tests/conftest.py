"""Test-wide set-up: CPU only, 4 fake devices (sharded tests compare against 1 device)."""

import os
import tempfile

# The demo model folder and other caches go to a session tmp folder, never ~/.cache.
os.environ.setdefault("RLFLOW_CACHE_DIR", tempfile.mkdtemp(prefix="rlflow-test-cache-"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
