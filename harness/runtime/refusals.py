"""What strict determinism refuses, said as one line: torch's alert for an op that has no deterministic kernel."""

from __future__ import annotations

import re

# at::Context::alertNotDeterministic (aten/src/ATen/Context.cpp) and its Python twin
# (torch/_prims_common / torch._refs via torch._check) both raise
#   "<caller> does not have a deterministic implementation, but you set
#    'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation, ..."
# where <caller> is the kernel's own name ("upsample_bilinear2d_backward_out_cuda",
# "adaptive_avg_pool2d_backward_cuda", "nll_loss2d_forward_out_cuda_template", "grid_sampler_2d_backward_cuda",
# "put_", "_histc_cuda with floating point input", ...). Under warn_only=True the same text is a warning
# that names "(True, warn_only=True)" instead: that one never stops a run, so it does not match here.
# The caller is a name, then maybe words ("... with floating point input"); searched for, not matched at the
# start, so that a library that re-raises it inside its own text ("layer 3: put_ does not ...") still names it.
_ALERT = re.compile(
    r"(?P<op>[A-Za-z_][\w.]*(?: [\w=.]+)*?) does not have a deterministic implementation, but you set "
    r"'torch\.use_deterministic_algorithms\(True\)'"
)


def refused_op(message: str) -> str | None:
    """The op torch refused to run under use_deterministic_algorithms(True), from its error's text; None for any
    other error."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    match = _ALERT.search(first)
    return match["op"] if match else None


def refusal_line(op: str, where: str | None) -> str:
    """The one line a run that strict mode stopped ends with: the op, the user's line, and the way out."""
    at = f" ({where})" if where else ""
    return (
        f"{op} has no deterministic implementation, so determinism.level=strict refused it{at}. "
        "Use another op there, or set determinism.level=warn to let it run with a warning "
        "(its results may then differ between runs, so a replay need not be BITWISE)."
    )
