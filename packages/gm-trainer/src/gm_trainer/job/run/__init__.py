"""Running a ``gm-train`` job: one rank's job (``runner``), its step loop and the hooks it
calls after each step (``loop``, ``hooks``), how a rank lays the model out (``placement``),
the ``--plan`` estimate of every kind of rank (``estimate``), where a process finds its place
(``launch``), rank 0's console (``progress``), metrics and their sinks (``telemetry``,
``sinks``) and the held-out evaluation (``evaluate``)."""
