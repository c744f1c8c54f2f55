"""rlflow.system.ports: launch ports come from outside the kernel's ephemeral range, so an
unrelated outgoing connection cannot take one between the launcher's pick and the child's bind."""

import socket

import pytest

from rlflow.system import ports


def test_ephemeral_range_reads_the_kernel_file(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(f)) == (40000, 50000)
    assert ports.ephemeral_range(str(tmp_path / "missing")) == (32768, 65535)


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    low, _ = ports.ephemeral_range()
    got = {ports.free_port() for _ in range(20)}
    for port in got:
        assert 10000 <= port < min(low, 32768)
        with socket.socket() as s:        # free: binding it works
            s.bind(("127.0.0.1", port))
    assert len(got) > 1                   # drawn at random, not one fixed port


def test_free_port_skips_bound_and_excluded_ports(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy, excluded = held.getsockname()[1], ports.free_port()
        free = ports.free_port(exclude={excluded})
        draws = iter([busy, excluded, free])
        monkeypatch.setattr(ports.random.SystemRandom, "randrange",
                            lambda self, a, b: next(draws))
        assert ports.free_port(exclude={excluded}) == free


def test_free_port_falls_back_to_the_kernel_when_no_range_is_left(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (10050, 60999))
    port = ports.free_port()
    assert port >= 10050                  # bind(0) hands out ephemeral ports only


def test_advertised_host_names_this_machine_only_for_wildcard_binds():
    import socket

    from rlflow.system.ports import WILDCARD_HOSTS, advertised_host, is_wildcard

    here = socket.gethostbyname(socket.gethostname())
    for host in WILDCARD_HOSTS:
        assert is_wildcard(host) and advertised_host(host) == here
    for host in ("127.0.0.1", "localhost", "::1", "10.0.0.5", ""):
        assert not is_wildcard(host) and advertised_host(host) == host


def test_port_taken_sees_a_listener_not_a_closed_port():
    import socket

    from rlflow.system.ports import port_taken

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_taken("127.0.0.1", port)
    assert not port_taken("127.0.0.1", port)


@pytest.mark.parametrize("flag, field", [("--buffer.port", "buffer.port"),
                                         ("--runtime.coordinator-port",
                                          "runtime.coordinator_port")])
def test_train_refuses_a_port_in_use_naming_the_field(monkeypatch, tmp_path, capsys, flag,
                                                      field):
    import socket

    from rlflow.console import cli
    from rlflow.launcher import supervisor

    monkeypatch.setattr(supervisor.Supervisor, "start",
                        lambda *a, **k: pytest.fail("a program was started"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code = cli.main(["train", "--run-dir", str(tmp_path), flag, str(port)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"rlflow train: {field}: port {port} on 127.0.0.1 is in use" in err
    assert "Traceback" not in err
