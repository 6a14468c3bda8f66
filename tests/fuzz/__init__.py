"""A differential fuzz suite for the pass: random RoPE-like functions (and non-rotations) compared with eager,
an fp64 evaluation and plain compile. generator.py writes the cases, harness.py runs and classifies them,
test_fuzz.py holds the fast fixed-seed profile and the long profile (see its docstring)."""
