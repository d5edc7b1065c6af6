"""The torch graph passes (each a GraphPass) and the graph surgery only they use."""
