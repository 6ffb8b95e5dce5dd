//! Prometheus metrics: counts and latency histograms of snapshot, restore,
//! fork, exec and suspend/resume; HTTP responses by status; live sandboxes
//! and template memory, measured when scraped.

use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OpLabels {
    pub op: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OpOnly {
    pub op: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StatusLabels {
    pub status: String,
}

pub(crate) struct Metrics {
    registry: Mutex<Registry>,
    ops: Family<OpLabels, Counter>,
    latency: Family<OpOnly, Histogram>,
    http: Family<StatusLabels, Counter>,
    live: Gauge,
    templates: Gauge,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let ops = Family::<OpLabels, Counter>::default();
        // 0.25 ms .. ~8 s.
        let latency = Family::<OpOnly, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.00025, 2.0, 16))
        });
        let http = Family::<StatusLabels, Counter>::default();
        let live = Gauge::default();
        let templates = Gauge::default();
        registry.register(
            "tine_operations",
            "Operations by kind (snapshot, restore, fork, exec, suspend, resume) and outcome",
            ops.clone(),
        );
        registry.register(
            "tine_operation_seconds",
            "Latency of operations, from request to result",
            latency.clone(),
        );
        registry.register(
            "tine_http_responses",
            "HTTP responses by status",
            http.clone(),
        );
        registry.register(
            "tine_live_sandboxes",
            "Sandboxes starting, running or restarting",
            live.clone(),
        );
        registry.register(
            "tine_template_bytes",
            "Private memory held by the live process templates of all snapshots",
            templates.clone(),
        );
        Metrics {
            registry: Mutex::new(registry),
            ops,
            latency,
            http,
            live,
            templates,
        }
    }

    pub fn observe(&self, op: &str, ok: bool, seconds: f64) {
        self.ops
            .get_or_create(&OpLabels {
                op: op.into(),
                outcome: if ok { "ok" } else { "error" }.into(),
            })
            .inc();
        self.latency
            .get_or_create(&OpOnly { op: op.into() })
            .observe(seconds);
    }

    pub fn response(&self, status: u16) {
        self.http
            .get_or_create(&StatusLabels {
                status: status.to_string(),
            })
            .inc();
    }

    /// The text exposition, with the gauges set to what they measure now.
    pub fn render(&self, live: usize, template_bytes: u64) -> String {
        self.live.set(live as i64);
        self.templates
            .set(template_bytes.min(i64::MAX as u64) as i64);
        let mut out = String::new();
        let reg = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        let _ = prometheus_client::encoding::text::encode(&mut out, &reg);
        out
    }
}
