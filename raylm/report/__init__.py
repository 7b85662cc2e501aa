"""What a plan means, for people: `raylm plan`'s report (the layout, memory and time per
rank, alternatives, stage tables) and which rank owns what under ZeRO. It sits above
raylm.plan (the decisions, pure) and raylm.parallel (it cuts the meta-device model as the
runtime would, to say exactly which rank holds which tensor).
"""
