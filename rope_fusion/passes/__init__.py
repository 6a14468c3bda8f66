"""Graph analysis and rewriting: lane algebra, matcher, sites, q/k grouping, emission, the pass."""

from .installation import inductor_options, install, installed, uninstall  # noqa: F401
from .report import Report  # noqa: F401
from .rope_pass import RopeFusionPass  # noqa: F401
