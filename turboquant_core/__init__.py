# SPDX-License-Identifier: Apache-2.0
"""TurboQuant KV-cache compression: random rotation + Lloyd-Max scalar codebooks, no calibration.

The format table (``formats``), codebooks, rotations, quantizers and packing are plain torch and
import no Triton; the fused kernels live in ``turboquant_core.ops`` and are imported on use.
"""

from .codebooks import lloyd_max_codebook
from .formats import KV_FORMATS, KVFormat, format_names, get_format
from .rotation import SUPPORTED_HEAD_DIMS

__version__ = "0.1.0"

__all__ = ["KV_FORMATS", "KVFormat", "SUPPORTED_HEAD_DIMS", "__version__", "format_names", "get_format",
           "lloyd_max_codebook"]
