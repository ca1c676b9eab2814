"""The ``compile_mode`` values ``torch.compile`` takes, in a module of their own: the config checks
read them without loading Lightning, which `attnlab.run.compilation` (the compiler's side) imports."""

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
