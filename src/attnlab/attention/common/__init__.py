"""The pieces every attention family shares, one small module each.

- ``layer``: the layer skeleton (`AttentionLayer`, `Capabilities`) and the option checks;
- ``checks``: shape checks of the q/k/v ops; ``padding``: what a padding mask removes;
  ``precision``: accumulation dtypes, autocast kept out; ``rope``: rotary position embedding;
- ``reference_masks``: the masks the float64 references share (and nothing of the ops);
- ``triton``: running the Triton kernels (probe, loading, first-use check, the shared kernel helpers);
- ``gpu_check``: whether this machine's GPUs run the torch build and Triton, asked at start.

The families (``softmax``, ``linear``, ``performer``, ``sliced_relu``, ``sliced_relu_bump``) import
from here; nothing here imports a family.
"""
