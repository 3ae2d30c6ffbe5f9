"""Models and tokenizers in: loading any Hugging Face model, the shipped pairs and heads (assets/), the
draft-to-target vocabulary mapping, the CLI's tokenizer check."""
