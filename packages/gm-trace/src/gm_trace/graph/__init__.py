"""The captured graph as values (JointGraph and what it carries), and helpers that read it."""
