"""The ``compile_mode`` values ``torch.compile`` takes, and the benchmarks' ``--compile`` choices, in a
module of their own: the config checks and the benchmarks read them without loading Lightning, which
`attnlab.run.compilation` (the compiler's side) imports."""

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
#: the benchmarks' ``--compile``: whether each row runs eager, compiled, or both
COMPILE_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}
COMPILED = "+compile"  # the suffix of a compiled row's name
