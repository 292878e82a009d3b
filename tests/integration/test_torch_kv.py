"""A multi-round session on the torch engine whose history KV crosses real NIXL both ways
(tests/unit/test_torch_kv_loopback.py: the session, there over the loopback transport).
"""

from __future__ import annotations

import pytest

from ampd.engine.torch_models import save_tiny_llama
from ampd.kv.transport import NixlTransport
from tests.unit.test_torch_kv_loopback import VOCAB, rounds_through


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab_size=VOCAB, layers=3)


@pytest.mark.timeout(120)
async def test_remote_and_local_rounds_through_nixl_equal_one_model(tiny_llama):
    await rounds_through(tiny_llama, NixlTransport)
