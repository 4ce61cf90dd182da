//! The tool tier of the harness: a real HAProxy in front of stand-ins rolled by hand. No root.

mod lb_roll;
