"""Storage: the schema, engine and sessions, migrations, plain-SQL reads of counters and cost."""
