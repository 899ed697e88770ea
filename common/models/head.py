"""The LM head in float32, shared by the learner's policy and the embedded engine.

A bf16 model's head run in bf16 rounds its logits to bf16: at logits of 8-32 that is an error of
0.03-0.06 per logit, which the softmax passes on to every log-prob, so a bf16 learner and engine
disagree on log-probs by that much before any real mismatch (and TIS clips spuriously). The
head is therefore computed from the hidden state and the head weight both upcast to float32, as
SGLang does with ``--enable-fp32-lm-head``. An fp32 model is unchanged (the same op). Importing
this module does not import torch.
"""

from __future__ import annotations

from typing import Any


def lm_logits(hidden: Any, weight: Any, bias: Any = None) -> Any:
    """``hidden @ weight.T + bias`` in float32 whatever the model's dtype (differentiable)."""
    import torch.nn.functional as F

    if hidden.dtype == weight.dtype and hidden.dtype.is_floating_point and hidden.itemsize >= 4:
        return F.linear(hidden, weight, bias).float()
    b = None if bias is None else bias.float()
    return F.linear(hidden.float(), weight.float(), b)
