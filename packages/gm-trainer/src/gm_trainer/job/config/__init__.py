"""The ``gm-train`` configuration: one dataclass per YAML section (``job_config``: the job and
its ``train``/``logging``/``profile``/``checkpoint`` sections, ``load_config``;
``sections``: ``model``, ``data``, ``dist``), the field checks they share (``validation``),
the world sizes a job runs on (``world``), the checks across sections (``checks``) and the
embedded ``default.yaml``."""
