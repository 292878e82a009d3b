"""Import-time stand-in for `sgl_kernel` (PyPI: sglang-kernel), for `make test-sglang` only (never in
the image or the package).

sgl_kernel is SGLang's CUDA kernel package: PyPI ships only a CUDA wheel (373 MB, needs CUDA torch);
its CPU build exists only as source. SGLang 0.5.23 imports it at module level in layers that AMPD's
CPU path loads but does not run (with SGLANG_USE_CPU_ENGINE=1 and attention_backend="torch_native",
no op of it is called on a CPU without AMX), and reads attributes at import time
(`quantization/utils.py`: `scalar_types.uint4b8`). Every name resolves; anything actually called
raises (`_absent.Absent`), so a path that needs a real kernel fails loudly instead of computing
something else.
"""

import _absent

__version__ = "0.4.10"
_absent.install(__import__(__name__))
