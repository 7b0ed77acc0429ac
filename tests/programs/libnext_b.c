/* Helper of dlsym_next.c: the definition of ca_next_probe after libnext_a's. */
int ca_next_probe(void) { return 2; }
