"""Pipeline parallelism: a model cut into stage modules that keep its parameter names, and the schedule that runs them."""
