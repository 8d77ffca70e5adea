"""Structured output: a request's constraint compiled into a grammar over the model's
vocabulary (llguidance), its matcher advanced on the tokens the request keeps, and the token
masks of each step (plain samples and every node of a draft tree) built on a thread while the
step's forward runs."""
