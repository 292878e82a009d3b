"""`ampd chat` as a user runs it, on a tiny random-weight Llama that carries SmolLM2's tokenizer
(the real model's text, the real chat template; the output is random text). Three user messages:
the first (the whole rendered conversation) and the third (long) prefill remotely, the second
(short) on the decode worker; each round prints its placement, TTFT, ITL and text."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ampd.chat.tokenizer import tokenizer_for
from ampd.engine.torch_models import save_tiny_llama

pytestmark = pytest.mark.timeout(300)

ROUND = re.compile(r"^  round (\d+): prefill (local|remote) on (\S+), (\d+) new tokens on (\d+) history \| "
                   r"TTFT (\d+\.\d+) s \| ITL (\d+\.\d+ s|-) \| (\d+) tokens \| (stop|length|tool_calls)$")


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-chat")
    tok = tokenizer_for("mock")  # SmolLM2's tokenizer (its eos <|im_end|> is id 2, as the tiny model's)
    save_tiny_llama(folder, vocab_size=len(tok), layers=2, max_positions=2048)
    tok.save_pretrained(folder)
    return folder


def test_chat_prints_each_rounds_text_timings_and_placement(tiny_chat_model, tmp_path):
    long = "Please answer this longer question carefully, in a few words, and take into account " \
           "everything we said before in this conversation about numbers and their products."
    r = subprocess.run(
        [sys.executable, "-m", "ampd", "chat", "--model", str(tiny_chat_model), "--max-tokens", "3",
         "--threshold-tokens", "32", "--run-dir", str(tmp_path), "--prompt", "What is 2 + 2?",
         "--prompt", "Thanks.", "--prompt", long],
        capture_output=True, text=True, timeout=280, env=dict(os.environ, NIXL_LOG_LEVEL="WARN"))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith("chat: model ") and "engine torch" in out[0] and "policy threshold" in out[0]
    assert re.match(r"deployment ready in \d+\.\d s", out[1])
    assert [line for line in out if line.startswith("user> ")] == \
        ["user> What is 2 + 2?", "user> Thanks.", f"user> {long}"]
    rounds = [m.groups() for line in out if (m := ROUND.match(line))]
    assert [int(g[0]) for g in rounds] == [0, 1, 2], r.stdout
    assert [g[1] for g in rounds] == ["remote", "local", "remote"]
    assert [g[2] for g in rounds] == ["prefill-0", "decode-0", "prefill-0"]
    new, hist = [int(g[3]) for g in rounds], [int(g[4]) for g in rounds]
    assert new[0] > 32 and new[1] < 32 < new[2]
    assert hist[0] == 0 and hist[1] > new[0] and hist[2] > hist[1]  # each round on the whole history
    for g in rounds:
        assert 1 <= int(g[7]) <= 3 and float(g[5]) > 0
        assert (g[6] == "-") == (int(g[7]) == 1)  # a one-token round has no ITL
    assert sum(line.startswith("    assistant> ") for line in out) >= 3
    assert out[-1] == "3 rounds answered"
    assert "Traceback" not in r.stderr


def test_chat_with_a_bad_model_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ampd", "chat", "--model", str(tmp_path / "nothing")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "ampd chat: error:" in r.stderr and "Traceback" not in r.stderr


def test_chat_talks_to_a_deployment_already_up_through_its_coordinators(tiny_chat_model, tmp_path):
    """`--coordinator-address A,B`: no deployment of its own; the conversation goes through the
    given coordinators (ampd.coordinators), as the front's and the bench client's do."""
    from ampd.chat.cli import TOOL_SPEC
    from ampd.launcher import Deployment, Options

    opts = Options(engine="torch", model=str(tiny_chat_model), prefill="tp1*1", decode="tp1*1", coordinators=2,
                   policy="threshold", threshold_tokens=32, tool=(TOOL_SPEC,), run_dir=str(tmp_path / "dep"))
    with Deployment(opts) as dep:
        assert "," in dep.coordinator
        r = subprocess.run(
            [sys.executable, "-m", "ampd", "chat", "--model", str(tiny_chat_model), "--max-tokens", "3",
             "--coordinator-address", dep.coordinator, "--prompt", "What is 2 + 2?", "--prompt", "Thanks."],
            capture_output=True, text=True, timeout=200, env=dict(os.environ, NIXL_LOG_LEVEL="WARN"))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.splitlines()
    assert not any(line.startswith(("chat: model ", "deployment ready")) for line in out), r.stdout
    assert [int(m.group(1)) for line in out if (m := ROUND.match(line))] == [0, 1], r.stdout
    assert out[-1] == "2 rounds answered"


def test_chat_names_a_coordinator_that_does_not_answer(tiny_chat_model):
    r = subprocess.run([sys.executable, "-m", "ampd", "chat", "--model", str(tiny_chat_model),
                        "--coordinator-address", "127.0.0.1:1", "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "cannot reach the coordinator at 127.0.0.1:1" in r.stderr, r.stderr
