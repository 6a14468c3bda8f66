"""Graph analysis and rewriting: lane algebra, matcher, q/k grouping, the pass."""

from .report import Report  # noqa: F401
from .rope_pass import RopeFusionPass, inductor_options, install, uninstall  # noqa: F401
