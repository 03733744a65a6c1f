"""pgoutput bytes -> messages: the only code that knows the protocol's bytes."""
