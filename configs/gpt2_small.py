"""GPT-2 small (124M) on a (data 2, model 4) mesh. Heavy on CPU: one step takes minutes."""


def get_config():
  return {
      "model": "gpt",
      "config": "gpt2-small",
      "overrides": {},
      "mesh": {"data": 2, "model": 4},
      "batch_size": 8,
      "steps": 2,
      "learning_rate": 3e-4,
      "seed": 0,
  }
