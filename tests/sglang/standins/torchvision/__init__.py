"""Import-time stand-in for `torchvision`, for `make test-sglang` only (never in the image or the package).

SGLang 0.5.23 imports torchvision at module level in its multimodal processors, which the model
loader's registry imports for every model; AMPD's text-only path never calls into it. PyPI's
torchvision wheels need SGLang's CUDA torch, which would replace the CPU torch 2.13.0. SGLang parses
`__version__`, so it must read as a version. Anything actually called raises (`_absent.Absent`).
"""

import _absent

__version__ = "0.28.0"
_absent.install(__import__(__name__))
