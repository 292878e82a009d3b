"""Helpers of the front's integration tests: a second front process beside a deployment's, and a
tiny random Llama with SmolLM2's tokenizer for the torch engine."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from ampd.grpcserver import read_ready_file


@contextlib.contextmanager
def extra_front(coordinator: str, redis_url: str, ready: Path, *flags: str) -> Iterator[str]:
    """A front process on ``coordinator`` with ``flags``; yields its URL once it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "services.frontend", "--coordinator-address", coordinator,
                             "--redis-url", redis_url, *flags, "--ready-file", str(ready)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        yield f"http://127.0.0.1:{read_ready_file(ready)['port']}"
    finally:
        proc.terminate()
        proc.wait(10)


def tiny_chat_llama(folder: Path) -> Path:
    """A tiny random Llama over SmolLM2's vocabulary, its tokenizer saved beside it, in ``folder``."""
    from ampd.chat.tokenizer import tokenizer_for
    from ampd.engine.torch_models import load_tokenizer, save_tiny_llama, smollm2_tokenizer_dir

    tok = load_tokenizer(smollm2_tokenizer_dir())
    save_tiny_llama(folder, vocab_size=len(tok), layers=2, hidden_size=32, max_positions=2048)
    tok.save_pretrained(folder)
    tokenizer_for.cache_clear()
    return folder
