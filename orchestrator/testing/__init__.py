"""Doubles and demo kits that the tests and `make demo` import: the scripted policy, the toy tokenizer, scripted
runs and the demo job."""
