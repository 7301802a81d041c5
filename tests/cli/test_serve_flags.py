"""Startup mistakes are found before the model loads and reported in one line naming the flag; defaults that depend
on the placement (the compute dtype) follow the rules."""
from __future__ import annotations

import socket

import pytest
import torch

from ktrans import cli
from ktrans.config import RULES_DIR
from ktrans.inject.rules import load_rules
from ktrans.model.source import parse_dtype


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if the model would be loaded."""
    import ktrans.api.server as server

    def load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(server, "load", load)


def test_busy_port_is_refused_before_loading(no_load, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--port {port}" in err[0] and "in use" in err[0]


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_port_out_of_range(no_load, capsys, port):
    assert cli.main(["serve", "--port", port]) == 2
    assert "--port must be between 0 and 65535" in capsys.readouterr().err


def test_unknown_host(no_load, capsys):
    assert cli.main(["serve", "--host", "no-such-host.invalid", "--port", "0"]) == 2
    assert "--host 'no-such-host.invalid'" in capsys.readouterr().err


def test_dtype_defaults_to_bf16_only_where_cuda_runs():
    assert load_rules(RULES_DIR / "Qwen3Next-serve.yaml").uses_cuda
    assert not load_rules(RULES_DIR / "Qwen3Next-cpu.yaml").uses_cuda
    assert parse_dtype(None, on_cuda=True) == torch.bfloat16 and parse_dtype(None) == torch.float32
    assert parse_dtype("float32", on_cuda=True) == torch.float32  # asked for: kept


def test_make_tiny_does_not_overwrite(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    assert cli.main(["make-tiny", "--gguf", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err and out.read_bytes() == b"keep me"
    assert cli.main(["make-tiny", "--gguf", "--out", str(out), "--force"]) == 0
    assert out.read_bytes()[:4] == b"GGUF"
