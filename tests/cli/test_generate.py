"""`ktrans generate` end to end, through the real console entry point (in-process main() for speed)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ktrans.cli import main

from ..model.helpers import generate, load, make_checkpoint, prompt_logprobs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("gen"), "small", seed=2)


def run_json(capsys, *argv) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_shape_and_greedy_determinism(ckpt, capsys):
    a = run_json(capsys, "--model_path", str(ckpt), "--prompt_ids", "5,17,300,2", "--max_new_tokens", "12",
                 "--logprobs", "3")
    assert a["prompt_ids"] == [5, 17, 300, 2]
    assert len(a["output_ids"]) == 12 and len(a["logprobs"]) == 12
    for step, tok in zip(a["logprobs"], a["output_ids"]):
        assert str(tok) in step and len(step) >= 3
        assert max(step.values()) == step[str(tok)]  # greedy picks the most likely token
    assert set(a["timings"]) >= {"load_s", "prefill_s", "decode_s"}
    b = run_json(capsys, "--model_path", str(ckpt), "--prompt_ids", "5,17,300,2", "--max_new_tokens", "12",
                 "--chunk_size", "3")
    assert b["output_ids"] == a["output_ids"]


def test_seeded_sampling_reproducible(ckpt, capsys):
    args = ["--model_path", str(ckpt), "--prompt_ids", "1,2,3", "--max_new_tokens", "10", "--temperature", "1.0",
            "--top_p", "0.9", "--top_k", "50"]
    a = run_json(capsys, *args, "--seed", "7")
    b = run_json(capsys, *args, "--seed", "7")
    c = run_json(capsys, *args, "--seed", "8")
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


def test_echo_scores_the_prompt(ckpt, capsys):
    out = run_json(capsys, "--model_path", str(ckpt), "--prompt_ids", "9,8,7,6,5", "--max_new_tokens", "0",
                   "--echo", "--logprobs", "2")
    assert out["output_ids"] == []
    assert len(out["prompt_logprobs"]) == 4  # every prompt position after the first
    for pos, tok in zip(out["prompt_logprobs"], [8, 7, 6, 5]):
        assert str(tok) in pos and all(v <= 0 for v in pos.values())
    # the same numbers as the model's own log-softmax over one direct forward
    direct = prompt_logprobs(load(ckpt), [9, 8, 7, 6, 5])
    for pos, tok, want in zip(out["prompt_logprobs"], [8, 7, 6, 5], direct):
        assert abs(pos[str(tok)] - want) < 1e-5


def test_chunked_prefill_and_stop_tokens(ckpt, tmp_path, capsys):
    """--chunk_size feeds the prompt to the engine in chunks of that many tokens: the same greedy tokens. An
    end-of-text token ends the output (kept in output_ids, finish_reason stop) unless --ignore_eos."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    args = ["--prompt_ids", ",".join(map(str, prompt)), "--max_new_tokens", "8"]
    a = run_json(capsys, "--model_path", str(ckpt), *args)
    b = run_json(capsys, "--model_path", str(ckpt), *args, "--chunk_size", "3")
    assert a["output_ids"] == b["output_ids"] == generate(load(ckpt), prompt, 8).token_ids
    assert a["finish_reason"] == "length"
    eos = a["output_ids"][3]
    first = a["output_ids"].index(eos)
    with_eos = make_checkpoint(tmp_path, "small", seed=2, eos_token_id=eos)  # same weights, this eos
    c = run_json(capsys, "--model_path", str(with_eos), *args)
    assert c["output_ids"] == a["output_ids"][:first + 1] and c["finish_reason"] == "stop"
    d = run_json(capsys, "--model_path", str(with_eos), *args, "--ignore_eos")
    assert d["output_ids"] == a["output_ids"] and d["finish_reason"] == "length"


def test_default_model_chat(capsys):
    out = run_json(capsys, "--chat", "Hi there", "--max_new_tokens", "4")
    assert out["prompt_ids"][:3] == [151644, 872, 198]  # <|im_start|>user\n
    assert len(out["output_ids"]) <= 4


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "x", "--prompt_ids", "1"], "exactly one of"),
    (["--prompt_ids", "1,a"], "--prompt_ids"),
    (["--prompt_ids", "999999"], "outside the vocabulary"),
    (["--prompt_ids", "1", "--max_new_tokens", "-1"], "--max_new_tokens"),
    (["--prompt_ids", "1", "--temperature", "-1"], "temperature"),
    (["--prompt_ids", "1", "--top_p", "0"], "top_p"),
    (["--prompt_ids", "1", "--model_path", "/nonexistent/dir"], "/nonexistent/dir"),
])
def test_bad_flags_name_the_flag(argv, message, capsys, ckpt):
    if "--model_path" not in argv:
        argv = [*argv, "--model_path", str(ckpt)]
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "ktrans.cli", "make-tiny", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--preset" in out.stdout


@pytest.mark.parametrize("given", [None, "ACTIVE"])
def test_openmp_threads_sleep_unless_the_user_says(given):
    """`ktrans` sets OMP_WAIT_POLICY=PASSIVE before torch loads (its OpenMP runtime reads it once), unless set."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    code = ("import os, sys\nfrom ktrans.cli import main\ntry:\n    main(['make-tiny', '--help'])\n"
            "except SystemExit:\n    pass\nprint(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.split()[-2:] == [given or "PASSIVE", "False"], out.stderr[-500:]
