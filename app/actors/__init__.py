"""The actor processes (ingress, tokenizer, scheduler, detokenizer) and their supervisor."""
