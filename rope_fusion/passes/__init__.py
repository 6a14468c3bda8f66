"""The pass, in the order it works: analysis/ proves the rotations and pairs q with k, kernel_sites/ claims the
rotary kernels already in a graph, auto/ chooses what each site becomes, folds/ takes the data movement around a
site into the fused node; rope_pass.py drives them, emission.py writes the graph, report*.py tell what happened.

The ways in (install(), the FX pass, the Dynamo backend, vLLM) live in rope_fusion/integrations/.
"""

from .report import Report  # noqa: F401
from .rope_pass import RopeFusionPass  # noqa: F401
