"""Engine options that keep an earlier chapter's behaviour on a later checkpoint, chosen by capability."""


def no_prefix_caching(checkpoint) -> dict:
    """From chapter 09 on, prefix caching turned off: a freed block is forgotten at once, as before."""
    return {"enable_prefix_caching": False} if "prefix_caching" in checkpoint.__capabilities__ else {}


def default_cpu_backend(checkpoint) -> str:
    """The attention backend an engine on CPU gets by default: from chapter 11 on, "cpu" (decode rows read
    the pool in place, compiled); before, "torch"."""
    return "cpu" if "compiled" in checkpoint.__capabilities__ else "torch"


def logits_tolerance(checkpoint) -> dict:
    """How close a checkpoint's fp32 logits stay to transformers': atol 1e-4 until chapter 10; from chapter 11
    on, fused and oneDNN-packed GEMMs and compiled reductions add up fp32 sums in another order over 30
    layers: atol 2e-4, and a tolerance that grows with the logit's size (rtol 2e-5: 2e-4 more on a logit of
    10). Greedy tokens stay exactly equal."""
    if "compiled" in checkpoint.__capabilities__:
        return {"atol": 2e-4, "rtol": 2e-5}
    return {"atol": 1e-4, "rtol": 0.0}


def exact_fp32_products(checkpoint) -> dict:
    """From chapter 18 on, quantized layers on fp32 compute multiply their dequantized weights exactly, as
    before, instead of quantizing few rows' activations to 8 bits for integer dot products."""
    return {"int8_activations": False} if "integer_dot" in checkpoint.__capabilities__ else {}
