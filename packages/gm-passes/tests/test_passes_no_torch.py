"""gm_passes never imports torch, not even to find and build its own pipeline."""

from __future__ import annotations


def test_importing_gm_passes_does_not_import_torch(assert_torch_free):
    assert_torch_free(
        """
        import gm_passes
        from gm_passes import base, base_passes, graph_ops, pipeline, registry
        from gm_config import PassConfig
        gm_passes.available_passes()
        assert gm_passes.get_pass("dce") is gm_passes.DeadCodeElimination
        config = PassConfig(fsdp_enabled=False, enable_overlap=False, recompute_pointwise=False)
        p = gm_passes.PassPipeline.from_config(config)
        assert p.names == ["dce", "canonicalize"], p.names
        """
    )
