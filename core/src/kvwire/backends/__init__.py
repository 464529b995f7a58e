"""Transfer backends that ship with kvwire."""
