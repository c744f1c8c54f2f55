"""Issue 18.2: the ring-buffer token comes from the environment or a 0600 file, never from
argv, and every config dump, log line and child command line shows it redacted."""

from __future__ import annotations

import io
import json
import logging
import os

import pytest

from rlflow.console import cli
from rlflow import config as C
from rlflow.launcher import supervisor
from rlflow.control import programs_common as pc
from rlflow.run.metrics import MetricsWriter
from rlflow.config.secrets import (ENV_BUFFER_TOKEN, REDACTED, SecretError, install_log_redaction,
                            redact_config, resolve_secrets, secret_values)

SECRET = "tok-5ad0c1e-secret"


def _cfg(tmp_path, **buffer):
    return C.ExperimentConfig(name="demo", run_dir=str(tmp_path),
                              buffer=C.BufferConfig(**buffer))


def test_token_sources_in_order_and_the_file_mode_is_checked(tmp_path):
    path = tmp_path / "token"
    path.write_text(SECRET + "\n")
    path.chmod(0o644)
    cfg = _cfg(tmp_path, bind_address="0.0.0.0", token_file=str(path))   # file: valid config
    with pytest.raises(SecretError, match=rf"{path} has mode 0644.*chmod 600"):
        resolve_secrets(cfg, env={})
    path.chmod(0o600)
    assert resolve_secrets(cfg, env={}).buffer.token == SECRET
    assert resolve_secrets(cfg, env={ENV_BUFFER_TOKEN: "from-env"}).buffer.token == "from-env"
    direct = _cfg(tmp_path, token="in-config-file")
    assert resolve_secrets(direct, env={ENV_BUFFER_TOKEN: "x"}).buffer.token == "in-config-file"
    with pytest.raises(SecretError, match="config.json from a run folder"):
        resolve_secrets(_cfg(tmp_path, token=REDACTED), env={})
    with pytest.raises(C.ConfigError, match="buffer.token.*RLFLOW_BUFFER_TOKEN"):
        C.BufferConfig(bind_address="0.0.0.0")


def test_config_dumps_hold_no_secret(tmp_path):
    cfg = _cfg(tmp_path, token=SECRET)
    assert redact_config(pc.config_to_dict(cfg))["buffer"]["token"] == REDACTED
    assert pc.config_to_dict(cfg)["buffer"]["token"] == SECRET     # the copy, not the original
    path = tmp_path / "child.json"
    pc.save_config(cfg, str(path))
    with MetricsWriter(str(tmp_path / "run")) as w:                # config.json + TensorBoard
        w.write_config(cfg)
    for d, _, names in os.walk(tmp_path):
        for name in names:
            with open(os.path.join(d, name), "rb") as f:
                assert SECRET.encode() not in f.read(), name
    # a program reads the redacted file back with the token from its environment
    assert pc.load_config(str(path), env={ENV_BUFFER_TOKEN: SECRET}).buffer.token == SECRET
    assert json.loads(path.read_text())["buffer"]["token"] == REDACTED


def test_log_lines_show_the_token_redacted():
    stream = io.StringIO()
    logger = logging.getLogger("rlflow.test_secrets")
    logger.propagate = False
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        install_log_redaction(secret_values(_cfg("/tmp", token=SECRET)), logger)
        logger.warning("connect with token %s failed", SECRET)
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue() == f"connect with token {REDACTED} failed\n"


def test_rlflow_train_refuses_the_token_on_its_command_line(capsys):
    for argv in (["--buffer.token", SECRET], [f"--buffer.token={SECRET}"]):
        assert cli.main(["train", *argv]) == 2
        err = capsys.readouterr().err
        assert "RLFLOW_BUFFER_TOKEN" in err and SECRET not in err
    cfg = cli.parse_train_args(["--buffer.token_file", "/run/secrets/t"])   # a path is fine
    assert cfg.buffer.token_file == "/run/secrets/t"


def test_children_get_the_token_by_environment_not_argv(tmp_path, monkeypatch):
    seen = {}

    class Popen:
        def __init__(self, argv, env, **kw):
            seen["argv"], seen["env"], self.pid = argv, env, 4242

    monkeypatch.setattr(supervisor.subprocess, "Popen", Popen)
    cfg = _cfg(tmp_path, token=SECRET)
    sup = supervisor.Supervisor(cfg, str(tmp_path), str(tmp_path / "config.json"),
                            pc.Endpoints("127.0.0.1:1", "127.0.0.1:2"))
    sup.start("learner")
    assert seen["env"][ENV_BUFFER_TOKEN] == SECRET
    assert not any(SECRET in word for word in seen["argv"])


def test_a_token_in_the_config_file_is_not_shown_by_help_all(tmp_path, capsys):
    path = tmp_path / "with_token.py"
    path.write_text("from rlflow.config import ExperimentConfig, BufferConfig\n"
                    "def config():\n"
                    f"    return ExperimentConfig(buffer=BufferConfig(token={SECRET!r}))\n")
    assert cli.parse_train_args(["--config", str(path)]).buffer.token == SECRET
    with pytest.raises(SystemExit):
        cli.parse_train_args(["--config", str(path), "--help-all"])
    out = capsys.readouterr().out
    assert "--buffer.token" in out and SECRET not in out
