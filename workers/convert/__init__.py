"""Model files of other formats turned into the Hugging Face directory specd serves: a GGUF file
(llama.cpp's) imported as config.json, safetensors and a tokenizer (`gguf_import.py`)."""
