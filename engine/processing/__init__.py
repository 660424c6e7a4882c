"""From request to tokens and back: tokenizer, chat templates, generation defaults, detokenization."""
