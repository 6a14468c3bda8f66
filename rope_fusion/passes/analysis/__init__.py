"""What the pass proves about a graph before it changes anything: the lane algebra (poly, lanes, lane_rules) that
reads every spelling of a rotation, the acceptance of a rotation (matcher, pair_matrix), the sites it finds
(sites, site), their q/k pairing and tables (grouping, gathers), the QK-norm before them (norms), and the graph
forms read first (aten_form, padded_sums, symbolic_sizes). Nothing here writes to the graph it reads."""
