"""Engine options that keep an earlier chapter's behaviour on a later checkpoint, chosen by capability."""


def no_prefix_caching(checkpoint) -> dict:
    """From chapter 09 on, prefix caching turned off: a freed block is forgotten at once, as before."""
    return {"enable_prefix_caching": False} if "prefix_caching" in checkpoint.__capabilities__ else {}
