//! HTTP checks: `GET /serving/<unit>` answers 200 `ready` while the unit runs a verified spec and
//! is ready, else 503 with the word and why (`drain: specd is stopping it to apply unit …`,
//! `down: …`): what HAProxy's `httpchk`, nginx, Envoy, Traefik and cloud load balancers ask. The
//! routes go on an endpoint that gives each request its peer's address (axum's `ConnectInfo`):
//! the agent's `listen`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Extension;
use axum::extract::{ConnectInfo, Path};
use axum::http::StatusCode;

use super::{Answers, unit_of};
use crate::core::serving::{CheckKind, http_answer};

/// The routes: `GET /serving/<unit>`.
pub fn routes(answers: Arc<Answers>) -> axum::Router {
    axum::Router::new().route(
        "/serving/{unit}",
        axum::routing::get(
            move |Path(name): Path<String>, peer: Option<Extension<ConnectInfo<SocketAddr>>>| async move {
                let Some(unit) = unit_of(&name) else {
                    return (StatusCode::NOT_FOUND, format!("{name:?} names no unit\n"));
                };
                let ip = peer.map_or(std::net::Ipv4Addr::UNSPECIFIED.into(), |c| c.0.0.ip());
                let (code, body) = http_answer(answers.answer(CheckKind::Http, &unit, ip).as_ref());
                (StatusCode::from_u16(code).unwrap_or(StatusCode::SERVICE_UNAVAILABLE), body)
            },
        ),
    )
}
