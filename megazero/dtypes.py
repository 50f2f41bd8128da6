"""The precision names that flags, presets, plans and conversions use (``--main-grads-dtype bf16``,
``--dtype fp16``), and their torch dtypes: one table, so a name means the same dtype everywhere."""
from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
