"""Python functions as torch operators that cost little per call.

A compiled graph calls what it cannot trace (oneDNN's packed weights, the attention backends, the quantized
kernels' choice) as an operator. `torch.library.custom_op` makes one in a line, but every call then runs
its Python wrapper: about 6 us more than the function, and 55 more for an operator that writes into its
arguments (measured on a 2-core Xeon). A step of SmolLM2 calls 121 linear layers, and a prompt step 30
attentions besides. An operator defined directly on a `torch.library.Library`, with one implementation for
every device, reaches its function through the dispatcher alone: 2 to 4 us more than the function.

Every copy of the package (the frozen chapters beside `rosellm`) defines its own operators, in a namespace
made from the defining module's package: `chapters_ch16_engine_core_rosellm::attention`,
`rosellm_attention::attention`, ...
"""

from collections.abc import Callable

import torch

_libraries: dict[str, torch.library.Library] = {}  # namespace -> the library its operators are defined on


def define_operator(package: str, fake: Callable, mutates_args: tuple[str, ...] = ()) -> Callable:
    """Decorator: the function becomes an operator of the namespace made from `package` (the caller's
    `__package__`), named as the function, its schema read from its type hints (`mutates_args` names the
    tensors it writes into); `fake` gives the compiler its output's shape without running it. Returns the
    operator, called with the function's arguments."""
    namespace = package.replace(".", "_")

    def define(function: Callable) -> Callable:
        if namespace not in _libraries:
            _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
        library, name = _libraries[namespace], function.__name__
        library.define(name + torch.library.infer_schema(function, mutates_args=mutates_args))
        library.impl(name, function, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{namespace}::{name}", fake, lib=library)
        return getattr(getattr(torch.ops, namespace), name).default

    return define
