"""How `auto` chooses what a site becomes: the cost model's view of a site (site_costs), the choosers, and the
measurements that settle what the cost model cannot (auto_timing and its budget, regions, consumers, clock),
stored per source hash (auto_decisions) and calibrated per GPU (calibration)."""
