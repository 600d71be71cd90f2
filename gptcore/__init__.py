"""gptcore: the model world of gptrun — data, tokenizer, GPT, AdamW, training loop, checkpoints.

Pure PyTorch + tokenizers + numpy + pyarrow. Never imports ray.
"""
