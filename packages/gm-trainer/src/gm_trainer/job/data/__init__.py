"""What a ``gm-train`` job reads: where the text is (``corpus``), its documents by format
(``documents``), the tokenizers (``tokenize``) and the packed, shuffled token windows the ranks
train and evaluate on (``windows``)."""
