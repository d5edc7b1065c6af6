"""The run folder of a ``gm-train`` job: what it holds and who writes it (``folder``), safe
file handling, its marker and its lock (``files``), and where a resumed job starts and what it
must agree with (``resume``)."""
