"""The inner side: the model, the tokenizer, the data stream, the inner AdamW steps and evaluation. Nothing here
knows about the swarm."""
