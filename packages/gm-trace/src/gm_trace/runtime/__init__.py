"""Running a traced joint graph on the live model."""
