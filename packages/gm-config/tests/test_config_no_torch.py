"""gm_config never imports torch (DESIGN: the orchestration layers are torch-free)."""

from __future__ import annotations


def test_importing_gm_config_does_not_import_torch(assert_torch_free):
    assert_torch_free(
        """
        import gm_config
        from gm_config import errors, pass_config, pass_plan, yaml_plan
        gm_config.PassConfig(fsdp_degree=2).to_dict()
        gm_config.PassPlan().add_pattern("layers.*").lookup("layers.0")
        """
    )
