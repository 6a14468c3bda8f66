"""Every way into the pass from outside it, in one folder: the places a user reaches the pass from are one kind of
thing whether they are torch.compile's own options or another project's pass manager.

- installation.py: `inductor_options()` and `install()` / `uninstall()`, the pass in Inductor's post-grad slot;
- fx_pass.py: `rope_fusion.fx_pass` / `FxPass`, the pass on ATen graphs that no Inductor compiles (npugraph_ex,
  TorchAir, aot_eager);
- dynamo_backend.py: `rope_fusion.backend(inner)`, a Dynamo backend built on the FX pass;
- vllm.py and vllm_ascend.py: the pass as vLLM's and vllm-ascend's pass managers take it;
- vllm_state.py: what vLLM is compiling for, which the pass reads without importing vllm.py;
- depyf_debug.py: `rope_fusion.debug(dump_dir)`, depyf's dump plus the pass's graphs before and after.

None of them is imported by `import rope_fusion`: the package's public names load them on first use. vLLM is
never imported by them (vllm.py waits for vLLM to be imported), depyf only when `rope_fusion.debug` is entered.
"""
