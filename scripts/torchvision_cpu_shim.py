"""Let PyPI's CUDA build of torchvision import beside a CPU build of torch.

Development-environment helper, installed into the virtualenv by scripts/bootstrap.sh (it is
not part of the dsv4_backend package). sglang imports torchvision eagerly; torchvision's fake
(meta) registrations look up ``torchvision::nms`` and ``torchvision::qnms``, which only its
compiled extension defines, and that extension does not load against CPU torch. This finder
defines the two schemas just before torchvision is first imported, so its pure-Python parts
work. It imports torch only when torchvision is imported.
"""

import contextlib
import importlib.abc
import sys


class _DefineTorchvisionSchemas(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        library = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            # RuntimeError: already defined by a working extension.
            with contextlib.suppress(RuntimeError):
                library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIBRARIES.append(library)
        return None  # let the regular finders load torchvision


_LIBRARIES: list = []
sys.meta_path.insert(0, _DefineTorchvisionSchemas())
