"""What a ``gm-train`` job trains: the built-in GPT (``builtin``), any ``transformers`` causal
LM (``hf``), the model, loss and plans built for ``model.source`` (``build``) and the export of
the final checkpoint for ``from_pretrained`` (``export_hf``)."""
